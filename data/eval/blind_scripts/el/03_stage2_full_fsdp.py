"""Stage-2 full fine-tuning (LLM + projector) with FSDP.

Rank 0 loads the real weights; the other ranks build the model on the meta
device and receive the weights through sync_module_states, so host RAM holds
one fp32 copy per node instead of one per GPU. The CLIP tower is frozen.

    torchrun --nproc_per_node 8 03_stage2_full_fsdp.py --config configs/stage2_13b.yaml
"""
import argparse
import functools
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from PIL import Image
from torch.distributed.fsdp import (FullStateDictConfig, FullyShardedDataParallel as FSDP,
                                    MixedPrecision, ShardingStrategy, StateDictType)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, CLIPImageProcessor,
                          CLIPVisionModel, get_cosine_schedule_with_warmup)
from transformers.models.clip.modeling_clip import CLIPEncoderLayer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

IGNORE_INDEX = -100
DEFAULTS = dict(llm="lmsys/vicuna-13b-v1.5", vision_tower="openai/clip-vit-large-patch14-336",
                projector_ckpt=None, train_json=None, val_json=None, image_folder=None,
                output_dir="checkpoints/stage2-13b", micro_batch=4, lr=2e-5, weight_decay=0.0,
                warmup_ratio=0.03, epochs=1, max_len=2048, eval_every=500, log_every=10)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = dict(DEFAULTS)
    cfg.update(yaml.safe_load(open(ap.parse_args().config)))
    return argparse.Namespace(**cfg)


def build_sample(conv, tok, max_len):
    ids, labels = [tok.bos_token_id], [IGNORE_INDEX]
    for turn in conv:
        text = turn["value"].replace("<image>", "").strip()
        if turn["from"] == "human":
            t = tok("USER: " + text + " ASSISTANT:", add_special_tokens=False).input_ids
            ids += t
            labels += [IGNORE_INDEX] * len(t)
        else:
            t = tok(" " + text + tok.eos_token, add_special_tokens=False).input_ids
            ids += t
            labels += t
    return ids[:max_len], labels[:max_len]


class LlavaData(Dataset):
    def __init__(self, path, image_folder, tok, proc, max_len):
        self.rows = json.load(open(path))
        self.image_folder, self.tok, self.proc, self.max_len = image_folder, tok, proc, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        img = Image.open(os.path.join(self.image_folder, r["image"])).convert("RGB")
        ids, labels = build_sample(r["conversations"], self.tok, self.max_len)
        return dict(index=i, input_ids=torch.tensor(ids), labels=torch.tensor(labels),
                    pixel_values=self.proc(img, return_tensors="pt")["pixel_values"][0])


def collate(batch, pad_id):
    ids = nn.utils.rnn.pad_sequence([b["input_ids"] for b in batch], batch_first=True, padding_value=pad_id)
    labels = nn.utils.rnn.pad_sequence([b["labels"] for b in batch], batch_first=True,
                                       padding_value=IGNORE_INDEX)
    return dict(index=torch.tensor([b["index"] for b in batch]), input_ids=ids, labels=labels,
                attention_mask=ids.ne(pad_id).long(),
                pixel_values=torch.stack([b["pixel_values"] for b in batch]))


class Llava(nn.Module):
    def __init__(self, llm, vision):
        super().__init__()
        self.llm, self.vision = llm, vision
        h = llm.config.hidden_size
        self.projector = nn.Sequential(nn.Linear(vision.config.hidden_size, h), nn.GELU(), nn.Linear(h, h))

    def forward(self, input_ids, attention_mask, labels, pixel_values):
        with torch.no_grad():
            feats = self.vision(pixel_values, output_hidden_states=True).hidden_states[-2][:, 1:]
        img = self.projector(feats)
        txt = self.llm.get_input_embeddings()(input_ids)
        n = img.size(1)
        x = torch.cat([txt[:, :1], img, txt[:, 1:]], dim=1)  # BOS, image, text
        mask = torch.cat([attention_mask[:, :1], attention_mask.new_ones(img.shape[:2]), attention_mask[:, 1:]], 1)
        y = torch.cat([labels[:, :1], labels.new_full((labels.size(0), n), IGNORE_INDEX), labels[:, 1:]], 1)
        return self.llm(inputs_embeds=x, attention_mask=mask, labels=y)


def build_model(cfg, rank):
    if rank == 0:
        llm = AutoModelForCausalLM.from_pretrained(cfg.llm, torch_dtype=torch.float32)
        vision = CLIPVisionModel.from_pretrained(cfg.vision_tower, torch_dtype=torch.float32)
        model = Llava(llm, vision)
        if cfg.projector_ckpt:
            sd = torch.load(cfg.projector_ckpt, map_location="cpu")
            model.projector.load_state_dict({k.replace("mm_projector.", ""): v for k, v in sd.items()})
    else:
        with torch.device("meta"):
            llm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.llm))
            vision = CLIPVisionModel(AutoConfig.from_pretrained(cfg.vision_tower).vision_config)
            model = Llava(llm, vision)
    model.vision.requires_grad_(False)
    return model


@torch.no_grad()
def evaluate(model, loader, rank):
    model.eval()
    records = []
    for batch in loader:
        idx = batch.pop("index")
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        out = model(**batch)
        ntok = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        records.append((int(idx[0]), out.loss.item() * ntok, ntok))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    model.train()
    if rank != 0:
        return None
    uniq = {i: (s, n) for part in gathered for i, s, n in part}  # drop the sampler's padded repeats
    return sum(s for s, _ in uniq.values()) / max(1, sum(n for _, n in uniq.values()))


def save_full_state(model, path, rank):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()
    if rank == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(state, path)
    dist.barrier()


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(cfg.llm, use_fast=False)
    tok.pad_token = tok.unk_token
    proc = CLIPImageProcessor.from_pretrained(cfg.vision_tower)

    model = build_model(cfg, rank)
    wrap = functools.partial(transformer_auto_wrap_policy,
                             transformer_layer_cls={LlamaDecoderLayer, CLIPEncoderLayer})
    model = FSDP(
        model,
        auto_wrap_policy=wrap,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                       buffer_dtype=torch.bfloat16),
        device_id=torch.cuda.current_device(),
        sync_module_states=True,
        param_init_fn=(lambda m: m.to_empty(device=torch.cuda.current_device(), recurse=False))
        if rank != 0 else None,
        use_orig_params=True,
        limit_all_gathers=True,
    )

    train_ds = LlavaData(cfg.train_json, cfg.image_folder, tok, proc, cfg.max_len)
    val_ds = LlavaData(cfg.val_json, cfg.image_folder, tok, proc, cfg.max_len)
    col = functools.partial(collate, pad_id=tok.pad_token_id)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg.micro_batch, sampler=train_sampler,
                              num_workers=8, pin_memory=True, collate_fn=col)
    val_loader = DataLoader(val_ds, batch_size=1, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=4, collate_fn=col)

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999))
    total = cfg.epochs * len(train_loader)
    sched = get_cosine_schedule_with_warmup(opt, math.ceil(cfg.warmup_ratio * total), total)
    writer = SummaryWriter(os.path.join(cfg.output_dir, "tb")) if rank == 0 else None

    step, t0 = 0, time.time()
    model.train()
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        for batch in train_loader:
            batch.pop("index")
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            gnorm = model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % cfg.log_every == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    writer.add_scalar("train/loss", l.item(), step)
                    writer.add_scalar("train/grad_norm", gnorm.item(), step)
                    writer.add_scalar("train/lr", sched.get_last_lr()[0], step)
                    print(f"step {step}/{total} loss {l.item():.4f} ({(time.time() - t0) / cfg.log_every:.2f}s/it)",
                          flush=True)
                    t0 = time.time()
            if step % cfg.eval_every == 0:
                val = evaluate(model, val_loader, rank)
                if rank == 0:
                    writer.add_scalar("val/loss", val, step)
                    print(f"step {step} val_loss {val:.4f}", flush=True)
        save_full_state(model, os.path.join(cfg.output_dir, f"epoch{epoch}", "model.pt"), rank)

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
