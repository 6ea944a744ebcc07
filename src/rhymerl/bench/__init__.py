"""Benchmarks run as commands (`rhymerl bench ...`): a table, then one JSON line of named figures."""
