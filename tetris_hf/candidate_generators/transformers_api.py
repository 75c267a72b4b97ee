from transformers.generation.candidate_generator import CandidateGenerator


class CandidateGeneratorAPI(CandidateGenerator):
    pass
