"""``filechannel.agent.tail``: where :class:`TailSource` lived; it is :mod:`filechannel.sources.tail` now.

Kept so the documented ``from filechannel.agent.tail import TailSource`` keeps
working; new code imports from :mod:`filechannel.sources.tail`.
"""

from filechannel.sources.tail import TailSource as TailSource
from filechannel.sources.tail import make_tails as make_tails
from filechannel.sources.tail import parse_tail_specs as parse_tail_specs
