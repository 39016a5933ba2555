"""`python -m fast`: the same as `python -m fast.run`."""

from fast.run import main

if __name__ == "__main__":
    main()
