# Prints nothing for several seconds while computing: not a hang.
#   quiet_compute.py SECONDS [staggered]   (staggered: local rank r computes r × SECONDS, so
#                                           rank 0 is done at once while the others go on)
import os
import sys
import time

seconds = float(sys.argv[1])
if "staggered" in sys.argv[2:]:
    seconds *= int(os.environ["LOCAL_RANK"])
start = time.monotonic()
x = 0
while time.monotonic() - start < seconds:
    x = (x * 31 + 7) % 1000003
print(f"computed {x}", flush=True)
