import sys

try:  # the CLI's imports (torch, transformers, pandas) take seconds: Ctrl-C then is one line too, not a traceback
    from .cli import main
except KeyboardInterrupt:
    print("error: interrupted while starting; nothing was run", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(main())
