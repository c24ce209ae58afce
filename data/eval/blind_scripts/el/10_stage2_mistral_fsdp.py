"""Stage-2 visual instruction tuning, Mistral-7B-Instruct + SigLIP, FSDP full shard.

Run on 2 nodes x 8 GPUs:
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 \
        10_stage2_mistral_fsdp.py --data /shared/vlm/stage2.json --images /shared/vlm/images \
        --projector /shared/vlm/runs/stage1/projector.pt --out /shared/vlm/runs/stage2
"""
import argparse
import functools
import json
import logging
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.distributed.fsdp import FullStateDictConfig
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForCausalLM, AutoTokenizer, SiglipImageProcessor, SiglipVisionModel,
                          get_cosine_schedule_with_warmup)
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer
from transformers.models.siglip.modeling_siglip import SiglipEncoderLayer

log = logging.getLogger(__name__)
IGNORE = -100


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--llm", default="mistralai/Mistral-7B-Instruct-v0.2")
    p.add_argument("--vision", default="google/siglip-so400m-patch14-384")
    p.add_argument("--projector", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--images", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--val_frac", type=float, default=0.01)
    p.add_argument("--bs", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--save_every", type=int, default=1000)
    p.add_argument("--eval_every", type=int, default=500)
    return p.parse_args()


def encode(conv, tok, max_len):
    ids, lab = [tok.bos_token_id], [IGNORE]
    for q, a in zip(conv[0::2], conv[1::2]):
        qi = tok(f"[INST] {q['value'].replace('<image>', '').strip()} [/INST]", add_special_tokens=False).input_ids
        ai = tok(" " + a["value"].strip(), add_special_tokens=False).input_ids + [tok.eos_token_id]
        ids += qi + ai
        lab += [IGNORE] * len(qi) + ai
    return ids[:max_len], lab[:max_len]


class VLData(Dataset):
    def __init__(self, rows, images, tok, proc, max_len):
        self.rows, self.images, self.tok, self.proc, self.max_len = rows, images, tok, proc, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        ids, lab = encode(r["conversations"], self.tok, self.max_len)
        px = self.proc(Image.open(os.path.join(self.images, r["image"])).convert("RGB"),
                       return_tensors="pt").pixel_values[0]
        return torch.tensor(ids), torch.tensor(lab), px


def collate(batch, pad_id):
    ids, lab, px = zip(*batch)
    ids = nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=pad_id)
    lab = nn.utils.rnn.pad_sequence(lab, batch_first=True, padding_value=IGNORE)
    mask = torch.zeros_like(ids)
    for i, t in enumerate(batch):
        mask[i, : len(t[0])] = 1
    return ids, mask, lab, torch.stack(px)


class MistralVLM(nn.Module):
    def __init__(self, llm, vision):
        super().__init__()
        self.llm, self.vision = llm, vision
        d = llm.config.hidden_size
        self.projector = nn.Sequential(nn.Linear(vision.config.hidden_size, d), nn.GELU(), nn.Linear(d, d))

    def forward(self, ids, mask, lab, px):
        with torch.no_grad():
            f = self.vision(px).last_hidden_state
        img = self.projector(f)
        txt = self.llm.get_input_embeddings()(ids)
        x = torch.cat([txt[:, :1], img, txt[:, 1:]], 1)
        m = torch.cat([mask[:, :1], mask.new_ones(img.shape[:2]), mask[:, 1:]], 1)
        y = torch.cat([lab[:, :1], lab.new_full(img.shape[:2], IGNORE), lab[:, 1:]], 1)
        return self.llm(inputs_embeds=x, attention_mask=m, labels=y).loss


def save_checkpoint(model, step, out):
    if dist.get_rank() == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        os.makedirs(out, exist_ok=True)
        torch.save({"model": state, "step": step}, os.path.join(out, f"step{step}.pt"))
        log.info("saved step %d", step)
    dist.barrier()


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    acc = torch.zeros(2, device="cuda")
    for ids, mask, lab, px in loader:
        loss = model(ids.cuda(), mask.cuda(), lab.cuda(), px.cuda())
        n = (lab[:, 1:] != IGNORE).sum()
        acc[0] += loss.float() * n
        acc[1] += n
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")

    tok = AutoTokenizer.from_pretrained(args.llm)
    tok.pad_token = tok.unk_token
    proc = SiglipImageProcessor.from_pretrained(args.vision)

    rows = [r for r in json.load(open(args.data)) if "image" in r]
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(rows), generator=g).tolist()
    n_val = int(len(rows) * args.val_frac)
    val_rows = [rows[i] for i in perm[:n_val]]
    train_rows = [rows[i] for i in perm[n_val:]]

    llm = AutoModelForCausalLM.from_pretrained(args.llm, torch_dtype=torch.bfloat16,
                                               attn_implementation="flash_attention_2")
    vision = SiglipVisionModel.from_pretrained(args.vision, torch_dtype=torch.bfloat16).requires_grad_(False)
    model = MistralVLM(llm, vision)
    model.projector.load_state_dict(torch.load(args.projector, map_location="cpu"))
    model.projector.to(torch.bfloat16)

    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={MistralDecoderLayer, SiglipEncoderLayer})
    model = FSDP(model, auto_wrap_policy=policy, sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.bfloat16),
                 device_id=local_rank, use_orig_params=True, limit_all_gathers=True)

    col = functools.partial(collate, pad_id=tok.pad_token_id)
    train_ds = VLData(train_rows, args.images, tok, proc, args.max_len)
    val_ds = VLData(val_rows, args.images, tok, proc, args.max_len)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True, collate_fn=col)
    val_loader = DataLoader(val_ds, batch_size=args.bs, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=4, collate_fn=col)

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    total = args.epochs * len(loader)
    sched = get_cosine_schedule_with_warmup(opt, math.ceil(0.03 * total), total)
    log.info("train=%d val=%d world=%d steps=%d", len(train_ds), len(val_ds), world, total)

    step = 0
    model.train()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for ids, mask, lab, px in loader:
            loss = model(ids.cuda(non_blocking=True), mask.cuda(non_blocking=True), lab.cuda(non_blocking=True),
                         px.cuda(non_blocking=True))
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                log.info("epoch %d step %d/%d loss %.4f lr %.2e", epoch, step, total, l.item(),
                         sched.get_last_lr()[0])
            if step % args.eval_every == 0:
                val_loss = evaluate(model, val_loader)
                log.info("step %d val_loss %.4f", step, val_loss)
            if step % args.save_every == 0:
                save_checkpoint(model, step, args.out)

    save_checkpoint(model, step, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
