# A module of warm_moves.py's own directory: a warm interpreter never imports it ahead.
import os

RANK_AT_IMPORT = os.environ.get("RANK")
