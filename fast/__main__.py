"""`python -m fast`: the same as `python -m fast.run`."""

from ref.common.errors import ctrl_c_quits_while_starting

ctrl_c_quits_while_starting(__name__)

from fast.run import main

if __name__ == "__main__":
    main()
