"""Stage-2 full fine-tuning of LLaVA-34B-style model with DeepSpeed ZeRO-3.

The LLM and CLIP tower are partitioned at load time (HfDeepSpeedConfig), the
projector is built under zero.Init and filled from the stage-1 weights.

    deepspeed --num_nodes 2 --num_gpus 8 --hostfile hostfile 16_stage2_zero3_full.py \
        --data /mnt/shared/vlm/mix665k.json --images /mnt/shared/vlm/images \
        --projector /mnt/shared/vlm/stage1/mm_projector.bin --out /mnt/shared/vlm/stage2-34b
"""
import argparse
import json
import math
import os

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, CLIPImageProcessor, CLIPVisionModel
from transformers.integrations import HfDeepSpeedConfig

IGNORE_INDEX = -100


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--llm", default="NousResearch/Nous-Hermes-2-Yi-34B")
    p.add_argument("--vision", default="openai/clip-vit-large-patch14-336")
    p.add_argument("--projector", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--val_data", default=None)
    p.add_argument("--images", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--micro_batch", type=int, default=4)
    p.add_argument("--global_batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max_len", type=int, default=4096)
    p.add_argument("--save_interval", type=int, default=500)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


def chatml(conv, tok, max_len):
    ids, lab = [], []
    for t in conv:
        role = "user" if t["from"] == "human" else "assistant"
        seg = tok(f"<|im_start|>{role}\n{t['value'].replace('<image>', '').strip()}<|im_end|>\n",
                  add_special_tokens=False).input_ids
        ids += seg
        lab += seg if role == "assistant" else [IGNORE_INDEX] * len(seg)
    return ids[:max_len], lab[:max_len]


class Data(Dataset):
    def __init__(self, path, images, tok, proc, max_len):
        self.rows = [r for r in json.load(open(path)) if "image" in r]
        self.images, self.tok, self.proc, self.max_len = images, tok, proc, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        ids, lab = chatml(r["conversations"], self.tok, self.max_len)
        px = self.proc(Image.open(os.path.join(self.images, r["image"])).convert("RGB"),
                       return_tensors="pt").pixel_values[0]
        return torch.tensor(ids), torch.tensor(lab), px


class Collate:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        ids, lab, px = zip(*batch)
        mask = nn.utils.rnn.pad_sequence([torch.ones_like(x) for x in ids], batch_first=True)
        ids = nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=self.pad_id)
        lab = nn.utils.rnn.pad_sequence(lab, batch_first=True, padding_value=IGNORE_INDEX)
        return ids, mask, lab, torch.stack(px).to(torch.bfloat16)


class LlavaYi(nn.Module):
    def __init__(self, llm, vision, projector):
        super().__init__()
        self.llm, self.vision, self.mm_projector = llm, vision, projector

    def forward(self, ids, mask, lab, px):
        with torch.no_grad():
            f = self.vision(px, output_hidden_states=True).hidden_states[-2][:, 1:]
        img = self.mm_projector(f)
        txt = self.llm.get_input_embeddings()(ids)
        x = torch.cat([img, txt], 1)
        m = torch.cat([mask.new_ones(img.shape[:2]), mask], 1)
        y = torch.cat([lab.new_full(img.shape[:2], IGNORE_INDEX), lab], 1)
        return self.llm(inputs_embeds=x, attention_mask=m, labels=y).loss


def save_projector(engine, path):
    """ZeRO-3 keeps only a shard of each weight per rank: gather on every rank, write on rank 0."""
    params = list(engine.module.mm_projector.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        if dist.get_rank() == 0:
            state = {k: v.detach().cpu().clone() for k, v in engine.module.mm_projector.state_dict().items()}
            torch.save(state, path)
    dist.barrier()


@torch.no_grad()
def evaluate(engine, loader):
    engine.eval()
    acc = torch.zeros(2, device=engine.device)
    for ids, mask, lab, px in loader:
        loss = engine(ids.to(engine.device), mask.to(engine.device), lab.to(engine.device), px.to(engine.device))
        acc += torch.stack([loss.float(), torch.ones((), device=engine.device)])
    dist.all_reduce(acc)
    engine.train()
    return (acc[0] / acc[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()

    accum = max(1, args.global_batch // (args.micro_batch * world))
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": accum,
        "train_batch_size": args.micro_batch * accum * world,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.999], "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e8,
            "stage3_prefetch_bucket_size": 5e8,
            "stage3_param_persistence_threshold": 1e6,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 10_000_000,
    }
    dschf = HfDeepSpeedConfig(ds_config)  # must stay alive so from_pretrained partitions the weights  # noqa: F841

    tok = AutoTokenizer.from_pretrained(args.llm)
    if tok.pad_token is None:
        tok.pad_token = tok.unk_token
    proc = CLIPImageProcessor.from_pretrained(args.vision)
    llm = AutoModelForCausalLM.from_pretrained(args.llm, torch_dtype=torch.bfloat16)
    llm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    vision = CLIPVisionModel.from_pretrained(args.vision, torch_dtype=torch.bfloat16).requires_grad_(False)

    d_llm = llm.config.hidden_size
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        projector = nn.Sequential(nn.Linear(vision.config.hidden_size, d_llm), nn.GELU(), nn.Linear(d_llm, d_llm))
    stage1 = torch.load(args.projector, map_location="cpu")
    stage1 = {k.split("mm_projector.")[-1]: v for k, v in stage1.items()}
    with deepspeed.zero.GatheredParameters(list(projector.parameters()), modifier_rank=0):
        if rank == 0:
            projector.load_state_dict(stage1)

    model = LlavaYi(llm, vision, projector)
    train_ds = Data(args.data, args.images, tok, proc, args.max_len)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.micro_batch, sampler=sampler, num_workers=6, pin_memory=True,
                        collate_fn=Collate(tok.pad_token_id), drop_last=True)
    val_loader = None
    if args.val_data:
        val_ds = Data(args.val_data, args.images, tok, proc, args.max_len)
        val_loader = DataLoader(val_ds, batch_size=args.micro_batch, collate_fn=Collate(tok.pad_token_id),
                                sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True), num_workers=2)

    total = args.epochs * (len(loader) // accum)
    ds_config["scheduler"] = {"type": "WarmupCosineLR",
                              "params": {"total_num_steps": total, "warmup_num_steps": math.ceil(0.03 * total)}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])

    start_epoch = 0
    if args.resume:
        _, client = engine.load_checkpoint(os.path.join(args.out, "ds_ckpt"))
        if client is not None:
            start_epoch = client["epoch"]
    if rank == 0:
        print(f"world={world} micro={args.micro_batch} accum={accum} global={ds_config['train_batch_size']} "
              f"steps={total}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        skip = (engine.global_steps - epoch * (len(loader) // accum)) * accum if epoch == start_epoch else 0
        for it, (ids, mask, lab, px) in enumerate(loader):
            if it < skip:
                continue
            loss = engine(ids.to(engine.device), mask.to(engine.device), lab.to(engine.device), px.to(engine.device))
            engine.backward(loss)
            engine.step()
            if (it + 1) % accum:
                continue
            gstep = engine.global_steps
            if gstep % 10 == 0:
                lt = loss.detach().float()
                dist.all_reduce(lt, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {gstep}/{total} loss {lt.item():.4f} "
                          f"lr {engine.get_lr()[0]:.2e}", flush=True)
            if gstep % args.save_interval == 0:
                engine.save_checkpoint(os.path.join(args.out, "ds_ckpt"), client_state={"epoch": epoch})
                if val_loader is not None:
                    val = evaluate(engine, val_loader)
                    if rank == 0:
                        print(f"step {gstep} val_loss {val:.4f}", flush=True)

    engine.save_checkpoint(os.path.join(args.out, "ds_ckpt"), client_state={"epoch": args.epochs})
    save_projector(engine, os.path.join(args.out, "mm_projector.bin"))
    engine.save_16bit_model(os.path.join(args.out, "full"), "pytorch_model.bin")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
