# The two commands of the README. Both install and start what they need.
.PHONY: up test stop

# Install and start the local infrastructure and run every role in one process (`txflow up`).
up:
	bash deploy/local/up.sh

# The whole test suite (formatting, lints, unit, adapter and end-to-end tests).
test:
	bash deploy/local/test.sh

# Stop the local services that `make up` or `make test` started.
stop:
	bash deploy/local/stop.sh
