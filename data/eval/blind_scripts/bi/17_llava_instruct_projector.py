"""LLaVA-style visual instruction tuning with a frozen Vicuna and a trainable MLP projector.

    torchrun --nproc_per_node 8 17_llava_instruct_projector.py \
        --data /data/llava/llava_v1_5_mix665k.json --image-folder /data/llava/images \
        --projector-init checkpoints/llava-v1.5-7b-pretrain/mm_projector.bin
"""
import argparse
import json
import os
import time
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForCausalLM, AutoTokenizer, CLIPImageProcessor, CLIPVisionModel,
                          get_cosine_schedule_with_warmup)

IGNORE = -100
SYSTEM = ("A chat between a curious human and an artificial intelligence assistant. "
          "The assistant gives helpful, detailed, and polite answers to the human's questions.")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--image-folder", required=True)
    ap.add_argument("--llm", default="lmsys/vicuna-7b-v1.5")
    ap.add_argument("--vision-tower", default="openai/clip-vit-large-patch14-336")
    ap.add_argument("--projector-init", default=None)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--output-dir", default="checkpoints/llava-v1.5-7b-projector-ft")
    return ap.parse_args()


class InstructData(Dataset):
    def __init__(self, path, image_folder, processor, tokenizer, max_len):
        with open(path) as f:
            self.items = [x for x in json.load(f) if "image" in x]
        self.image_folder, self.processor = image_folder, processor
        self.tokenizer, self.max_len = tokenizer, max_len

    def __len__(self):
        return len(self.items)

    def _encode(self, text):
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def __getitem__(self, i):
        item = self.items[i]
        img = Image.open(os.path.join(self.image_folder, item["image"])).convert("RGB")
        pixel_values = self.processor(img, return_tensors="pt").pixel_values[0]
        # vicuna_v1 template; the image goes where "<image>" appears in the first human turn
        pre_ids = [self.tokenizer.bos_token_id] + self._encode(SYSTEM + " USER:")
        post_ids, post_labels = [], []
        for turn in item["conversations"]:
            value = turn["value"].replace("<image>", "").strip()
            if turn["from"] == "human":
                ids = self._encode(" " + value + " ASSISTANT:")
                post_ids += ids
                post_labels += [IGNORE] * len(ids)
            else:
                ids = self._encode(" " + value) + [self.tokenizer.eos_token_id]
                nxt = self._encode(" USER:")
                post_ids += ids + nxt
                post_labels += ids + [IGNORE] * len(nxt)
        post_ids, post_labels = post_ids[: self.max_len], post_labels[: self.max_len]
        return pixel_values, torch.tensor(pre_ids), torch.tensor(post_ids), torch.tensor(post_labels)


def collate(batch, pad_id):
    return (torch.stack([b[0] for b in batch]), [b[1] for b in batch], [b[2] for b in batch],
            [b[3] for b in batch])


class Projector(nn.Module):
    def __init__(self, vdim, hdim):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(vdim, hdim), nn.GELU(), nn.Linear(hdim, hdim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def assemble(llm, image_tokens, pre, post, labels, device):
    """Right-padded inputs_embeds of [pre][image tokens][post] with matching labels."""
    emb = llm.get_input_embeddings()
    seqs, tgts = [], []
    for b in range(image_tokens.shape[0]):
        e = torch.cat([emb(pre[b].to(device)), image_tokens[b].to(emb.weight.dtype), emb(post[b].to(device))])
        t = torch.cat([torch.full((len(pre[b]) + image_tokens.shape[1],), IGNORE), labels[b]]).to(device)
        seqs.append(e)
        tgts.append(t)
    L = max(s.shape[0] for s in seqs)
    x = image_tokens.new_zeros((len(seqs), L, seqs[0].shape[-1]), dtype=seqs[0].dtype)
    y = torch.full((len(seqs), L), IGNORE, device=device)
    m = torch.zeros((len(seqs), L), dtype=torch.long, device=device)
    for b, (s, t) in enumerate(zip(seqs, tgts)):
        x[b, :len(s)], y[b, :len(t)], m[b, :len(s)] = s, t, 1
    return x, y, m


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tokenizer = AutoTokenizer.from_pretrained(args.llm, use_fast=False)
    tokenizer.pad_token = tokenizer.unk_token
    # one full copy of the LLM per rank, placed on this rank's own GPU
    llm = AutoModelForCausalLM.from_pretrained(args.llm, torch_dtype=torch.bfloat16,
                                               device_map={"": local_rank})
    llm.requires_grad_(False)
    # Llama has no dropout, so train mode only switches on gradient checkpointing
    llm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    llm.train()
    vision = CLIPVisionModel.from_pretrained(args.vision_tower, torch_dtype=torch.bfloat16).to(device).eval()
    vision.requires_grad_(False)
    processor = CLIPImageProcessor.from_pretrained(args.vision_tower)

    projector = Projector(vision.config.hidden_size, llm.config.hidden_size)
    if args.projector_init:
        state = torch.load(args.projector_init, map_location="cpu")
        projector.load_state_dict({k.replace("net.0.", "fc1.").replace("net.2.", "fc2."): v
                                   for k, v in state.items()})
    # only the projector is trained, so only it is wrapped; the frozen towers stay outside DDP
    projector = DDP(projector.to(device), device_ids=[local_rank])

    data = InstructData(args.data, args.image_folder, processor, tokenizer, args.max_len)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.micro_batch, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, collate_fn=partial(collate, pad_id=tokenizer.pad_token_id))

    optimizer = torch.optim.AdamW(projector.parameters(), lr=args.lr, weight_decay=0.0)
    steps = args.epochs * (len(loader) // args.accum)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.03 * steps), steps)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    update = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        stats = torch.zeros(2, device=device)
        t0 = time.time()
        for i, (pixels, pre, post, labels) in enumerate(loader):
            if i >= (len(loader) // args.accum) * args.accum:
                break
            do_step = (i + 1) % args.accum == 0
            with torch.no_grad():
                feats = vision(pixels.to(device, torch.bfloat16), output_hidden_states=True).hidden_states[-2][:, 1:]
            with projector.no_sync() if not do_step else nullcontext():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    img_tokens = projector(feats.float())
                    x, y, m = assemble(llm, img_tokens, pre, post, labels, device)
                    loss = llm(inputs_embeds=x, attention_mask=m, labels=y).loss
                (loss / args.accum).backward()
            stats += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if not do_step:
                continue
            torch.nn.utils.clip_grad_norm_(projector.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            update += 1
            if update % 20 == 0:
                dist.all_reduce(stats)
                if rank == 0:
                    print(f"epoch {epoch} update {update}/{steps} loss {(stats[0] / stats[1]).item():.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e} {(time.time() - t0) / (i + 1):.2f}s/it", flush=True)
                stats.zero_()
            if update % 1000 == 0 and rank == 0:
                torch.save(projector.module.state_dict(), os.path.join(args.output_dir, f"projector_{update}.bin"))

    if rank == 0:
        torch.save(projector.module.state_dict(), os.path.join(args.output_dir, "mm_projector.bin"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
