"""``python -m retrospec.gpu plan|prepare|step|report ...`` (what the device calls run; see ``cli.gpu_cmd``)."""

from ..cli.gpu_cmd import main

raise SystemExit(main())
