"""``python -m minillm.distributed``: a worker rank with no options of its own to compare,
which follows rank 0 (:func:`~minillm.distributed.follower.follow`). Rank 0 starts one per
other rank when it spawns its workers on this machine; the environment says where rank 0 is."""

import sys

from minillm.distributed.follower import follow

sys.exit(follow())
