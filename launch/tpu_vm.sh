#!/usr/bin/env bash
# Run launch/train.py on a Cloud TPU VM (the TPU is local to the VM):
#
#   launch/tpu_vm.sh [train.py flags...]
#   launch/tpu_vm.sh --model=resnet --compression=dct --steps=2000 --model_dir=gs://bucket/run1
#
# It is exactly `python3 -m launch.train --replicator=tpu --tpu=local "$@"`.
# TPU replicas have no static replica id, so DCT-MP across devices
# (--num_devices_per_replica > 1) is not available there; mask-only splits
# are. Without a TPU, train.py stops before training with the TpuReplicator's
# error naming --tpu.
set -eu
if [[ $# -ge 1 && ( "$1" == "-h" || "$1" == "--help" ) ]]; then
  sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec "${PYTHON:-python3}" -m launch.train --replicator=tpu --tpu="${TPU_NAME:-local}" "$@"
