"""fleetrl launcher: composes the run config, places the pools on Ray, shows progress."""
