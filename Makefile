# The two commands of the README are `make demo` and `make test`.
.PHONY: demo up test stop

# Install and start the local infrastructure and run the demo (`txflow demo`).
demo:
	bash deploy/local/demo.sh

# Install and start the local infrastructure and run every role in one process (`txflow up`).
up:
	bash deploy/local/up.sh

# The whole test suite (formatting, lints, unit, adapter and end-to-end tests).
test:
	bash deploy/local/test.sh

# Stop the local services that `make demo`, `make up` or `make test` started.
stop:
	bash deploy/local/stop.sh
