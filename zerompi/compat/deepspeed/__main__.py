"""``python -m zerompi.deepspeed train.py [args]``: the runner (runner.py)."""
from zerompi.compat.deepspeed.runner import main

main()
