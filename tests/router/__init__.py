"""Tests of the router (router/): HTTP API, registry, dispatch, with fake workers."""
