"""An ``evaluate`` metric: how far generated token sequences agree with reference generations.

Loaded by path (no hub needed): ``evaluate.load(tetris_hf.tools.metrics.OUTPUT_AGREEMENT)``.
"""

import datasets
import evaluate

_DESCRIPTION = """Token-level agreement of generations with reference generations of the same prompts: the fraction of
sequences identical to their reference (exact_match), the fraction of reference positions where the prediction has the
same token (token_agreement), and the mean index of the first differing token (mean_first_divergence, equal to the
reference length when identical)."""

_KWARGS_DESCRIPTION = """
Args:
    predictions: list of token-id lists.
    references: list of token-id lists, one per prediction.
Returns:
    exact_match (float), token_agreement (float), mean_first_divergence (float), num_sequences (int).
"""


def _first_divergence(prediction, reference):
    for index, (a, b) in enumerate(zip(prediction, reference)):
        if a != b:
            return index
    return min(len(prediction), len(reference)) if len(prediction) != len(reference) else len(reference)


class OutputAgreement(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Value("int64")),
                    "references": datasets.Sequence(datasets.Value("int64")),
                }
            ),
        )

    def _compute(self, predictions, references):
        if not predictions:
            return {"exact_match": 1.0, "token_agreement": 1.0, "mean_first_divergence": 0.0, "num_sequences": 0}
        exact = sum(list(p) == list(r) for p, r in zip(predictions, references))
        same = sum(sum(a == b for a, b in zip(p, r)) for p, r in zip(predictions, references))
        total = sum(max(len(p), len(r)) for p, r in zip(predictions, references))
        divergence = [_first_divergence(list(p), list(r)) for p, r in zip(predictions, references)]
        return {
            "exact_match": exact / len(predictions),
            "token_agreement": same / total if total else 1.0,
            "mean_first_divergence": sum(divergence) / len(divergence),
            "num_sequences": len(predictions),
        }
