# Exported from tetris_hf/candidate_generators/transformers_api.py by `python -m tetris_hf.tools.hub_export`: edit the package, not this copy.
from transformers.generation.candidate_generator import CandidateGenerator


class CandidateGeneratorAPI(CandidateGenerator):
    pass
