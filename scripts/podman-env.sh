# Source me: podman/buildah with this project's storage and settings only
# (scripts/containers/), as root. The host's /etc/containers is left as it is.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export CONTAINERS_CONF="$here/containers/containers.conf"
export CONTAINERS_STORAGE_CONF="$here/containers/storage.conf"
mkdir -p /var/lib/dsv4-serve/containers/networks /run/dsv4-serve/libpod/tmp
