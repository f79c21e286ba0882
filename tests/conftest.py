"""Every test runs the page pool with its full checks on (a page id repeated in one call, a page freed, pinned or
referenced in the wrong state): the replay's hot path skips them, the invariants tests must catch them."""
from tangram.paging import PagePool

PagePool.validate = True
