"""``python -m minillm`` (what ``make serve`` runs until the server chapter): make sure there is
a trained ``cpu`` model, training it on first use, then show what it writes."""

from __future__ import annotations

from minillm.machine.doctor import run_banner
from minillm.train.trainer import load_or_train, sample


def main() -> int:
    print(run_banner(preset="cpu"), flush=True)
    model = load_or_train("cpu")
    for i, prompt in enumerate(["", "Once upon a time", "Lily found a"]):
        print(f"\n--- sample {i + 1} ---\n{sample(model, max_new_tokens=120, prompt=prompt, seed=i)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
