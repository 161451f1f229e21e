"""Prefix index backends behind one interface (:class:`cachecore.index.base.PrefixIndex`)."""
