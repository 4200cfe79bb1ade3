"""An environment for the e2e tests that writes down the record each trajectory gets and then
vandalizes it: the lookup task, with one JSON line per ``reset`` (the record as received)
appended to the file ``$VERLITE_TEST_WITNESS`` names, after which it edits the prompt and
removes the answer of the dict it was given. A sibling trajectory handed the same dict would
be logged with the edit, or fail its own ``reset`` for want of an answer."""

import json
import os

from verlite.envs.lookup import Lookup


class Witness(Lookup):
    def reset(self, record):
        with open(os.environ["VERLITE_TEST_WITNESS"], "a") as log:
            log.write(json.dumps(record) + "\n")
        super().reset(record)
        record["prompt"] += "M"
        del record["answer"]
