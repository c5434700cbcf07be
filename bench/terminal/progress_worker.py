import sys, time, os
for i in range(30):
    sys.stderr.write(f"\rstep {i}/30"); sys.stderr.flush(); time.sleep(0.1)
sys.stderr.write("\n")
