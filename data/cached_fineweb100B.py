"""Download the first N of the 1030 FineWeb-100B training shards (GPT-2 tokens, 100M each) and the val shard.

Usage: python data/cached_fineweb100B.py [N] [--out-dir DIR]
"""

import sys

from hub_download import FINEWEB100B, main

if __name__ == "__main__":
    sys.exit(main(FINEWEB100B))
