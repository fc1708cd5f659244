"""A Hugging Face export does not depend on the mesh its checkpoint was saved on (scripts/convert_to_hf.py reads DCP
checkpoints of any layout): the shared TP 2 x FSDP 2 and PP 2 x FSDP 2 runs' checkpoints export to the very bytes
that the same weights give when one process saved them."""

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from launch import STEPS, ckpt
from safetensors.torch import load_file

from torchtitan_lite.checkpoint.reader import read_metadata
from torchtitan_lite.config import load_config
from torchtitan_lite.models.llama3.model import Transformer
from torchtitan_lite.tools.hf_convert import export_to_hf
from torchtitan_lite.tools.memory import model_args


# run -> the ranks that saved a piece of block 0's wq: TP 2 x FSDP 2, each a TP half of an FSDP half; PP 2 x FSDP 2,
# the FSDP halves of the first stage (the other stage's ranks saved the later blocks).
SAVED_BY = {"tp2_fsdp2": 4, "pp2_fsdp2": 2}


@pytest.mark.parametrize("layout", SAVED_BY)
def test_export_of_a_sharded_checkpoint_equals_the_export_of_one_process(runs, tmp_path, layout):
    run = runs[layout]
    sharded = str(ckpt(run, STEPS))
    assert len(read_metadata(sharded).state_dict_metadata["model.layers.0.attention.wq.weight"].chunks) == \
        SAVED_BY[layout]
    args = model_args(load_config(["--job.config_file", str(run / "config.toml")]))[0]
    model = Transformer(args)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # DCP warns that no process group exists, which is the point here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=sharded, no_dist=True)  # reassembled from the 4 ranks' shards
        dcp.save(state, checkpoint_id=str(tmp_path / "one_process"), no_dist=True)
    export_to_hf(sharded, tmp_path / "hf_mesh", args, bos_id=256, eos_id=257)
    export_to_hf(tmp_path / "one_process", tmp_path / "hf_one", args, bos_id=256, eos_id=257)
    mesh, one = (load_file(tmp_path / name / "model.safetensors") for name in ("hf_mesh", "hf_one"))
    assert mesh.keys() == one.keys() and len(mesh) == len(state["model"])
    for name in mesh:
        assert torch.equal(mesh[name], one[name]), name
    assert (tmp_path / "hf_mesh" / "config.json").read_text() == (tmp_path / "hf_one" / "config.json").read_text()
