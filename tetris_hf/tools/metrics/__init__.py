"""``evaluate`` metric modules shipped with the package, loaded by path (no hub needed)."""

from pathlib import Path

OUTPUT_AGREEMENT = str(Path(__file__).parent / "output_agreement" / "output_agreement.py")


def load_output_agreement():
    """The ``output_agreement`` metric as an ``evaluate.EvaluationModule``."""
    import evaluate

    return evaluate.load(OUTPUT_AGREEMENT)
