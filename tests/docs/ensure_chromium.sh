#!/bin/sh
# The browser tests (tests/docs/test_browser.py) drive Debian's chromium through Playwright; no
# browser download works here, so the test set-up installs Debian's package where it is missing.
# It never fails the run: without root, apt-get or the network the browser tests skip, saying why.
command -v chromium >/dev/null 2>&1 && exit 0
command -v chromium-browser >/dev/null 2>&1 && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "chromium missing (the browser tests will skip): apt-get install chromium as root to run them"
    exit 0
fi
echo "installing Debian's chromium for the browser tests (apt-get install chromium)"
{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1 \
    || echo "apt-get install chromium failed: the browser tests will skip"
exit 0
