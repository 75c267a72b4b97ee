"""``evaluate`` metric modules shipped with the package, loaded by path (no hub needed)."""

from pathlib import Path

OUTPUT_AGREEMENT = str(Path(__file__).parent / "output_agreement" / "output_agreement.py")


def output_agreement_path() -> str:
    """:data:`OUTPUT_AGREEMENT`, after checking that the file is there: a missing one is a one-line
    ``FileNotFoundError`` naming it and how to install the package with it (``evaluate`` would say neither)."""
    if not Path(OUTPUT_AGREEMENT).is_file():
        from ..models import ASSETS_INSTALL

        raise FileNotFoundError(f"{OUTPUT_AGREEMENT} is missing (this install of tetris-hf lacks its shipped metric): "
                                f"{ASSETS_INSTALL}")
    return OUTPUT_AGREEMENT


def load_output_agreement():
    """The ``output_agreement`` metric as an ``evaluate.EvaluationModule``."""
    import evaluate

    return evaluate.load(output_agreement_path())
