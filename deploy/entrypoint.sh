#!/bin/sh
# The image's entry point: `txflow "$@"`, with a default OpenTelemetry service.instance.id.
#
# Through an OpenTelemetry Collector, a process's metrics are told apart by service.instance.id
# (the Prometheus exporter's `instance` label): two replicas of a role with the same
# OTEL_SERVICE_NAME and no instance id would be merged into one series. The container's (or
# pod's) host name is unique per replica, so it is the default; an id set in
# OTEL_RESOURCE_ATTRIBUTES is kept.
set -eu
case ",${OTEL_RESOURCE_ATTRIBUTES:-}," in
  *,service.instance.id=*) ;;
  *)
    instance="${HOSTNAME:-$(cat /proc/sys/kernel/hostname)}"
    OTEL_RESOURCE_ATTRIBUTES="service.instance.id=${instance}${OTEL_RESOURCE_ATTRIBUTES:+,$OTEL_RESOURCE_ATTRIBUTES}"
    export OTEL_RESOURCE_ATTRIBUTES
    ;;
esac
exec /usr/local/bin/txflow "$@"
