"""``python -m ltx_mgpu``: the command-line engine (see :mod:`ltx_mgpu.cli.main`)."""

from ltx_mgpu.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
