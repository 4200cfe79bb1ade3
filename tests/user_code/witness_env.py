"""An environment for the e2e tests that writes down the record each trajectory gets and then
vandalizes it: the lookup task, with one JSON line per ``reset`` (the record as received)
appended to the file ``$VERLITE_TEST_WITNESS`` names, after which it edits the prompt and
removes the answer of the dict it was given. A sibling trajectory handed the same dict would
be logged with the edit, or fail its own ``reset`` for want of an answer. A step's
environments are reset side by side in several threads: the log is written under a lock."""

import json
import os
import threading

from verlite.envs.lookup import Lookup

_LOG = threading.Lock()


class Witness(Lookup):
    def reset(self, record):
        with _LOG, open(os.environ["VERLITE_TEST_WITNESS"], "a") as log:
            log.write(json.dumps(record) + "\n")
        super().reset(record)
        record["prompt"] += "M"
        del record["answer"]
