"""python -m executor_service.default_model {OUT_DIR | train [...] | corpus}: copy the embedded model out,
retrain it, or regenerate its generated corpus."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from executor_service.default_model.corpus import generate_corpus
from executor_service.default_model.model import GENERATED_CORPUS_PATH, TRAINED_MODEL_DIR


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["train"]:
        from executor_service.default_model.training import main as train_main  # needs transformers (dev extra)

        return train_main(args[1:])
    if args == ["corpus"]:
        GENERATED_CORPUS_PATH.write_text(generate_corpus(), encoding="utf-8")
        print(GENERATED_CORPUS_PATH)
        return 0
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m executor_service.default_model {OUT_DIR | train [--help] | corpus}", file=sys.stderr)
        return 2
    out = Path(args[0])
    shutil.copytree(TRAINED_MODEL_DIR, out, dirs_exist_ok=True)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
