r"""kvjax on a GPU or TPU against the chip's physical floor, as a script.

  python benchmarks/accelerator.py          # = python -m kvjax.bench --preset=accelerator
  python benchmarks/accelerator.py --sections=kernel,decode --out=/tmp/acc

Run from the repository's root (the model shape is configs/llama3_2_1b.py).
The sections, rows and floor: kvjax/bench/accelerator/.
"""

import sys

from kvjax.bench import main

if __name__ == "__main__":
  sys.argv[1:1] = ["--preset=accelerator"]
  main.run()
