"""Download the first N of the 99 FineWeb-Edu-10B training shards (GPT-2 tokens, 100M each) and the val shard.

Usage: python data/cached_finewebedu10B.py [N] [--out-dir DIR]
"""

import sys

from hub_download import FINEWEBEDU10B, main

if __name__ == "__main__":
    sys.exit(main(FINEWEBEDU10B))
