"""``python -m ltx_mgpu``: the command-line engine (see ``ltx_mgpu.cli``)."""

from ltx_mgpu.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
