#!/usr/bin/env bash
# System libraries that SAPIEN/ManiSkill need to render on a machine without
# a GPU: a Vulkan loader plus Mesa's lavapipe (a CPU Vulkan driver); and what
# LIBERO's MuJoCo renderer needs there: Mesa's EGL and DRI drivers (software
# rasteriser, MUJOCO_GL=egl, the default) and OSMesa (MUJOCO_GL=osmesa).
#
# Debian 12's own Mesa (22.x) ships a lavapipe that SAPIEN 3 rejects, so the
# driver comes from bookworm-backports (Mesa 25.x). Run as root; idempotent:
# when a new-enough lavapipe is already installed it checks and exits 0 at
# once. Python needs no exported variables afterwards: joynexus.agents.envs
# points the Vulkan loader at lavapipe's ICD file itself when none is set.
set -euo pipefail

log() { echo "system_setup: $*" >&2; }

# Mesa 25 names it lvp_icd.json, older packages lvp_icd.<arch>.json.
lvp_icd() { ls /usr/share/vulkan/icd.d/lvp_icd*.json 2>/dev/null | head -n1; }
MIN_MESA_MAJOR=23
# libegl1/libgl1/libglib2.0-0/libx11-6 are what the sapien and opencv wheels
# load besides Vulkan; small, and present on most machines already.
EXTRA_PKGS=(libvulkan1 libegl1 libgl1 libglib2.0-0 libx11-6 libxext6 libgomp1)
# Mesa's GL side, from the same Mesa release as lavapipe (their packages share
# mesa-libgallium, so they come from bookworm-backports together).
MESA_GL_PKGS=(libegl-mesa0 libgl1-mesa-dri libosmesa6)

installed_version() { dpkg-query -W -f='${Status} ${Version}\n' "$1" 2>/dev/null | awk '$3=="installed"{print $4}'; }

mesa_ok() {
  local v major
  v=$(installed_version mesa-vulkan-drivers)
  [ -n "$v" ] || return 1
  major=${v%%.*}; major=${major##*:}
  [ "$major" -ge "$MIN_MESA_MAJOR" ] 2>/dev/null || return 1
  [ -n "$(lvp_icd)" ] || return 1
  local p
  for p in "${MESA_GL_PKGS[@]}"; do [ -n "$(installed_version "$p")" ] || return 1; done
}

extras_ok() {
  local p
  for p in "${EXTRA_PKGS[@]}"; do [ -n "$(installed_version "$p")" ] || return 1; done
}

if mesa_ok && extras_ok; then
  log "lavapipe $(installed_version mesa-vulkan-drivers), Mesa EGL/OSMesa and Vulkan loader already installed; nothing to do"
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  log "must run as root (installs Debian packages); try: sudo bash $0"
  exit 1
fi

. /etc/os-release
if [ "${VERSION_CODENAME:-}" != "bookworm" ]; then
  log "written for Debian 12 (bookworm), found '${PRETTY_NAME:-unknown}'; install Mesa >= ${MIN_MESA_MAJOR} (mesa-vulkan-drivers) and libvulkan1 by hand"
  exit 1
fi

export DEBIAN_FRONTEND=noninteractive
if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
  log "adding bookworm-backports to /etc/apt/sources.list.d/bookworm-backports.sources"
  cat > /etc/apt/sources.list.d/bookworm-backports.sources <<'SRC'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
fi

log "apt-get update"
apt-get update -qq >&2

log "installing ${EXTRA_PKGS[*]}"
apt-get install -y -qq --no-install-recommends "${EXTRA_PKGS[@]}" >/dev/null

if ! mesa_ok; then
  log "installing mesa-vulkan-drivers (lavapipe) and ${MESA_GL_PKGS[*]} from bookworm-backports"
  apt-get install -y -qq --no-install-recommends -t bookworm-backports mesa-vulkan-drivers \
    "${MESA_GL_PKGS[@]}" >/dev/null
fi

if ! mesa_ok; then
  log "Mesa not usable after install (need mesa-vulkan-drivers >= ${MIN_MESA_MAJOR}, /usr/share/vulkan/icd.d/lvp_icd*.json and ${MESA_GL_PKGS[*]}); check 'apt-cache policy mesa-vulkan-drivers libosmesa6'"
  exit 1
fi
log "ready: lavapipe $(installed_version mesa-vulkan-drivers) at $(lvp_icd)"
