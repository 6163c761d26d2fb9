"""Download the first N of the 99 FineWeb-Edu-10B training shards (GPT-2 tokens, 100M each) and the val shard.

Usage: python data/cached_finewebedu10B.py [N] [--out-dir DIR]
"""

import sys

try:
    from hub_download import FINEWEBEDU10B, main
except ImportError as missing:  # a Python without the requirements, e.g. outside the virtual environment
    if __name__ != "__main__":
        raise  # an importer reports it in its own way
    sys.exit(f"data/cached_finewebedu10B.py: error: cannot import {missing.name or missing} in {sys.executable}; install the requirements "
             f"(pip install -r requirements.txt, README.md#install) or run the Python that has them")

if __name__ == "__main__":
    sys.exit(main(FINEWEBEDU10B))
