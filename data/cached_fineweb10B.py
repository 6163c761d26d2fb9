"""Download the first N of the 103 FineWeb-10B training shards (GPT-2 tokens, 100M each) and the val shard.

Usage: python data/cached_fineweb10B.py [N] [--out-dir DIR]
"""

import sys

from hub_download import FINEWEB10B, main

if __name__ == "__main__":
    sys.exit(main(FINEWEB10B))
