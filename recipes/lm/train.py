"""Train a language model from the command line: `LMRunConfig`'s fields are the flags.

    dew tokenize --input data/kjv.txt.xz --out data/kjv-byte --tokenizer byte
    python recipes/lm/train.py data:token-windows --data.path data/kjv-byte --data.seq-len 256 \
        --model.config '{"emb_features": 256, "num_layers": 4, "num_heads": 4, "max_seq_len": 256}' \
        --trainer.steps 2000 --trainer.run-dir runs/kjv

`dew train` is the same command. `--help` lists every flag; docs/recipes.md describes the run
directory it leaves.
"""

import sys

from dew.recipes.lm import main

if __name__ == "__main__":
    sys.exit(main())
