# Sleeps argv[1] seconds, after importing torch (as a training script would).
import sys
import time

import torch  # noqa: F401

time.sleep(float(sys.argv[1]))
