# A script whose entry point is decorated with torch's @record and raises.
import os
from torch.distributed.elastic.multiprocessing.errors import record


def helper():
    raise ValueError(f"planted failure on rank {os.environ['RANK']}")


@record
def main():
    if os.environ["RANK"] == "1":
        helper()
    import time
    time.sleep(30)


if __name__ == "__main__":
    main()
