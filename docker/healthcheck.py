"""Docker HEALTHCHECK for exspec: exit 0 when GET /health answers 200, 1 otherwise (503 while dying).

Slim images have no curl, so this uses the standard library. The port comes from EXSPEC_PORT."""

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    url = f"http://127.0.0.1:{os.environ.get('EXSPEC_PORT', '8000')}/health"
    request = urllib.request.Request(url)
    if os.environ.get("EXSPEC_API_KEY"):
        request.add_header("Authorization", f"Bearer {os.environ['EXSPEC_API_KEY']}")
    try:
        with urllib.request.urlopen(request, timeout=4) as response:
            return 0 if response.status == 200 else 1
    except (urllib.error.URLError, OSError) as e:
        print(f"exspec health check failed: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
