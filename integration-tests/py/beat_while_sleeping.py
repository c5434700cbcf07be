# Sleeps (no CPU, no output) but sends the explicit heartbeat: not a hang.
#   beat_while_sleeping.py SECONDS [--no-beat]   (without the beats the same sleep is a hang)
import os
import sys
import time

beat = "--no-beat" not in sys.argv
for _ in range(int(float(sys.argv[1]) / 0.5)):
    time.sleep(0.5)
    if beat:
        os.utime(os.environ["RLAUNCH_HEARTBEAT_FILE"])
print("slept", flush=True)
