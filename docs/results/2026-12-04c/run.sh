#!/bin/bash
# The script as run for this reference (2026-12-04, 11:07-11:50): the earlier reference's
# script with its outputs under /tmp/bench3 instead of /tmp/bench (it was generated this way).
mkdir -p /tmp/bench3
sed -e 's#/tmp/bench/#/tmp/bench3/#g' "$(dirname "$0")/../2026-12-04/run.sh" | bash
