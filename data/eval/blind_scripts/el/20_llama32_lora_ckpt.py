"""Stage-2 LoRA tuning: SigLIP-so400m + Llama-3.2-3B-Instruct, DDP on 2x8 GPUs.

Checkpoints (LoRA + projector + optimizer) go to the shared project volume so a
preempted job can restart from the latest one.

    srun --nodes 2 --ntasks-per-node 1 torchrun --nnodes 2 --nproc_per_node 8 \
        --rdzv_backend c10d --rdzv_endpoint $MASTER:29400 20_llama32_lora_ckpt.py \
        --data /proj/vlm/data/stage2.json --images /proj/vlm/images --ckpt_dir /proj/vlm/ckpt/l32-lora
"""
import argparse
import glob
import json
import math
import os
import re
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForCausalLM, AutoTokenizer, SiglipImageProcessor, SiglipVisionModel,
                          get_cosine_schedule_with_warmup)

IGNORE_INDEX = -100


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llm", default="meta-llama/Llama-3.2-3B-Instruct")
    ap.add_argument("--vision", default="google/siglip-so400m-patch14-384")
    ap.add_argument("--projector", default="/proj/vlm/ckpt/l32-stage1/projector.pt")
    ap.add_argument("--data", required=True)
    ap.add_argument("--images", required=True)
    ap.add_argument("--ckpt_dir", required=True)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--proj_lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--ckpt_every", type=int, default=500)
    return ap.parse_args()


class Stage2Data(Dataset):
    def __init__(self, path, images, tok, proc, max_len):
        self.rows = [r for r in json.load(open(path)) if "image" in r]
        self.images, self.tok, self.proc, self.max_len = images, tok, proc, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        ids, lab = [self.tok.bos_token_id], [IGNORE_INDEX]
        for t in r["conversations"]:
            role = "user" if t["from"] == "human" else "assistant"
            seg = self.tok(f"<|start_header_id|>{role}<|end_header_id|>\n\n"
                           f"{t['value'].replace('<image>', '').strip()}<|eot_id|>", add_special_tokens=False).input_ids
            ids += seg
            lab += seg if role == "assistant" else [IGNORE_INDEX] * len(seg)
        px = self.proc(Image.open(os.path.join(self.images, r["image"])).convert("RGB"),
                       return_tensors="pt").pixel_values[0]
        return torch.tensor(ids[: self.max_len]), torch.tensor(lab[: self.max_len]), px


class Collator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        ids, lab, px = zip(*batch)
        mask = nn.utils.rnn.pad_sequence([torch.ones_like(x) for x in ids], batch_first=True)
        return (nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=self.pad_id), mask,
                nn.utils.rnn.pad_sequence(lab, batch_first=True, padding_value=IGNORE_INDEX), torch.stack(px))


class L32VLM(nn.Module):
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
        y = torch.cat([lab[:, :1], lab.new_full(img.shape[:2], IGNORE_INDEX), lab[:, 1:]], 1)
        return self.llm(inputs_embeds=x, attention_mask=m, labels=y).loss


def latest_checkpoint(ckpt_dir):
    paths = glob.glob(os.path.join(ckpt_dir, "step_*.pt"))
    if not paths:
        return None
    return max(paths, key=lambda p: int(re.search(r"step_(\d+)", p).group(1)))


def save_checkpoint(model, opt, sched, step, epoch, ckpt_dir):
    os.makedirs(ckpt_dir, exist_ok=True)
    state = {
        "lora": get_peft_model_state_dict(model.module.llm),
        "projector": model.module.projector.state_dict(),
        "opt": opt.state_dict(),
        "sched": sched.state_dict(),
        "step": step,
        "epoch": epoch,
    }
    torch.save(state, os.path.join(ckpt_dir, f"step_{step}.pt"))


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(args.llm)
    tok.pad_token = "<|finetune_right_pad_id|>"
    proc = SiglipImageProcessor.from_pretrained(args.vision)
    llm = AutoModelForCausalLM.from_pretrained(args.llm, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    llm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    llm = get_peft_model(llm, LoraConfig(r=64, lora_alpha=128, lora_dropout=0.05, task_type="CAUSAL_LM",
                                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                         "gate_proj", "up_proj", "down_proj"]))
    vision = SiglipVisionModel.from_pretrained(args.vision, torch_dtype=torch.bfloat16).requires_grad_(False)
    model = L32VLM(llm, vision)
    model.projector.load_state_dict(torch.load(args.projector, map_location="cpu"))
    model.projector.to(torch.bfloat16)
    model = DDP(model.to(device), device_ids=[local_rank])

    ds = Stage2Data(args.data, args.images, tok, proc, args.max_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True,
                        collate_fn=Collator(tok.pad_token_id))

    opt = torch.optim.AdamW([
        {"params": [p for p in model.module.llm.parameters() if p.requires_grad], "lr": args.lr},
        {"params": list(model.module.projector.parameters()), "lr": args.proj_lr},
    ], weight_decay=0.0)
    total = args.epochs * len(loader)
    sched = get_cosine_schedule_with_warmup(opt, math.ceil(0.03 * total), total)

    step, start_epoch = 0, 0
    ckpt = latest_checkpoint(args.ckpt_dir)
    if ckpt is not None:
        state = torch.load(ckpt, map_location="cpu")
        set_peft_model_state_dict(model.module.llm, state["lora"])
        model.module.projector.load_state_dict(state["projector"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step, start_epoch = state["step"], state["epoch"]
        if rank == 0:
            print(f"resuming from {ckpt} (step {step})", flush=True)

    steps_per_epoch = len(loader)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        skip = step - epoch * steps_per_epoch
        t0 = time.time()
        for i, (ids, mask, lab, px) in enumerate(loader):
            if i < skip:
                continue
            loss = model(ids.to(device), mask.to(device), lab.to(device), px.to(device, torch.bfloat16))
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total} loss {l.item():.4f} "
                          f"{(time.time() - t0) / 10:.2f}s/it", flush=True)
                t0 = time.time()
            if step % args.ckpt_every == 0:
                save_checkpoint(model, opt, sched, step, epoch, args.ckpt_dir)
                dist.barrier()

    if rank == 0:
        final = os.path.join(args.ckpt_dir, "final")
        model.module.llm.save_pretrained(final)
        torch.save(model.module.projector.state_dict(), os.path.join(final, "projector.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
