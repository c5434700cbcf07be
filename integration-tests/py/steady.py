# A job with a steady step period and no collectives (plain Python, quick to start): every rank
# prints one line per step.
#   steady.py stall   rank 1 stops for good after 10 s (sleeps in stuck_here); rank 0 goes on
#   steady.py pause   every rank pauses 6 s once (a checkpoint) after 8 s, then finishes at 20 s
import os
import sys
import time

PERIOD = 0.5


def stuck_here():
    time.sleep(3600)


def main():
    rank = int(os.environ["RANK"])
    mode = sys.argv[1]
    start = time.monotonic()
    paused = False
    step = 0
    while time.monotonic() - start < (60 if mode == "stall" else 20):
        elapsed = time.monotonic() - start
        if mode == "stall" and rank == 1 and elapsed > 10:
            stuck_here()
        if mode == "pause" and not paused and elapsed > 8:
            paused = True
            time.sleep(6)
        print(f"step {step}", flush=True)
        step += 1
        time.sleep(PERIOD)


main()
