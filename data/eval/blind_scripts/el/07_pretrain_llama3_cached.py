"""Stage-1 projector pretraining for the Llama-3-8B + CLIP-L/336 VLM.

Tokenising the 558k captions takes ~10 minutes, so the tokenised captions are
cached next to the annotation file and reused by later runs (and by the
hyper-parameter sweeps that share the same data).

    torchrun --nnodes 1 --nproc_per_node 8 07_pretrain_llama3_cached.py \
        --ann /data/LLaVA-Pretrain/blip_laion_cc_sbu_558k.json --images /data/LLaVA-Pretrain/images
"""
import argparse
import hashlib
import json
import logging
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, CLIPImageProcessor, CLIPVisionModel

logger = logging.getLogger("pretrain")
IGNORE_INDEX = -100


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llm", default="meta-llama/Meta-Llama-3-8B-Instruct")
    ap.add_argument("--vision", default="openai/clip-vit-large-patch14-336")
    ap.add_argument("--ann", required=True)
    ap.add_argument("--images", required=True)
    ap.add_argument("--output", default="runs/llama3-clip-pretrain")
    ap.add_argument("--micro_bs", type=int, default=32)
    ap.add_argument("--grad_accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=float, default=0.03)
    ap.add_argument("--max_len", type=int, default=256)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


def tokenize_captions(records, tokenizer, max_len):
    out = []
    for r in tqdm(records, desc="tokenizing", mininterval=30):
        cap = r["conversations"][1]["value"].strip()
        ids = tokenizer(cap, add_special_tokens=False).input_ids[: max_len - 2]
        out.append([tokenizer.bos_token_id] + ids + [tokenizer.eos_token_id])
    return out


def load_or_build_cache(ann_path, tokenizer, max_len):
    records = json.load(open(ann_path))
    key = hashlib.md5(f"{tokenizer.name_or_path}-{max_len}".encode()).hexdigest()[:8]
    cache_path = f"{os.path.splitext(ann_path)[0]}.tok-{key}.json"
    if os.path.exists(cache_path):
        logger.info("loading tokenised captions from %s", cache_path)
        with open(cache_path) as f:
            token_ids = json.load(f)
    else:
        token_ids = tokenize_captions(records, tokenizer, max_len)
        with open(cache_path, "w") as f:
            json.dump(token_ids, f)
        logger.info("wrote tokenised captions to %s", cache_path)
    return records, token_ids


class PretrainSet(Dataset):
    def __init__(self, records, token_ids, image_dir, processor):
        assert len(records) == len(token_ids)
        self.records, self.token_ids, self.image_dir, self.processor = records, token_ids, image_dir, processor

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.image_dir, self.records[i]["image"])).convert("RGB")
        return torch.tensor(self.token_ids[i]), self.processor(img, return_tensors="pt")["pixel_values"][0]


class Collate:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        ids, px = zip(*batch)
        ids = nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=self.pad_id)
        mask = torch.zeros_like(ids)
        for i, t in enumerate(batch):
            mask[i, : len(t[0])] = 1
        labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
        labels[:, 0] = IGNORE_INDEX
        return ids, mask, labels, torch.stack(px)


class VLM(nn.Module):
    def __init__(self, llm, vision):
        super().__init__()
        self.llm, self.vision = llm, vision
        h = llm.config.hidden_size
        self.projector = nn.Sequential(nn.Linear(vision.config.hidden_size, h), nn.GELU(), nn.Linear(h, h))

    def forward(self, ids, mask, labels, px):
        with torch.no_grad():
            feats = self.vision(px, output_hidden_states=True).hidden_states[-2][:, 1:]
        img = self.projector(feats.float()).to(torch.bfloat16)
        txt = self.llm.get_input_embeddings()(ids)
        # [BOS] [image] caption [EOS]
        x = torch.cat([txt[:, :1], img, txt[:, 1:]], 1)
        m = torch.cat([mask[:, :1], mask.new_ones(img.shape[:2]), mask[:, 1:]], 1)
        y = torch.cat([labels[:, :1], labels.new_full(img.shape[:2], IGNORE_INDEX), labels[:, 1:]], 1)
        return self.llm(inputs_embeds=x, attention_mask=m, labels=y).loss


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(message)s")

    tokenizer = AutoTokenizer.from_pretrained(args.llm)
    tokenizer.pad_token = "<|finetune_right_pad_id|>" if "<|finetune_right_pad_id|>" in tokenizer.get_vocab() \
        else tokenizer.eos_token
    processor = CLIPImageProcessor.from_pretrained(args.vision)
    records, token_ids = load_or_build_cache(args.ann, tokenizer, args.max_len)

    llm = AutoModelForCausalLM.from_pretrained(args.llm, torch_dtype=torch.bfloat16,
                                               attn_implementation="flash_attention_2").requires_grad_(False)
    vision = CLIPVisionModel.from_pretrained(args.vision, torch_dtype=torch.bfloat16).requires_grad_(False)
    model = VLM(llm, vision).cuda()
    ddp = DDP(model, device_ids=[local_rank])

    ds = PretrainSet(records, token_ids, args.images, processor)
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=args.micro_bs, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, collate_fn=Collate(tokenizer.pad_token_id),
                        persistent_workers=True)

    opt = torch.optim.AdamW(model.projector.parameters(), lr=args.lr, weight_decay=0.0)
    total = len(loader) // args.grad_accum
    warm = int(args.warmup * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / max(1, warm) if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))
    logger.info("samples=%d world=%d global_bs=%d steps=%d", len(ds), world,
                args.micro_bs * args.grad_accum * world, total)

    sampler.set_epoch(0)
    ddp.train()
    step, tic = 0, time.time()
    for it, (ids, mask, labels, px) in enumerate(loader):
        ids, mask, labels = ids.cuda(non_blocking=True), mask.cuda(non_blocking=True), labels.cuda(non_blocking=True)
        px = px.cuda(non_blocking=True).to(torch.bfloat16)
        sync = (it + 1) % args.grad_accum == 0
        if sync:
            loss = ddp(ids, mask, labels, px)
            (loss / args.grad_accum).backward()
        else:
            with ddp.no_sync():
                loss = ddp(ids, mask, labels, px)
                (loss / args.grad_accum).backward()
        if not sync:
            continue
        torch.nn.utils.clip_grad_norm_(model.projector.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 50 == 0:
            lt = loss.detach()
            dist.all_reduce(lt)
            logger.info("step %d/%d loss %.4f lr %.2e %.2fs/step", step, total, lt.item() / world,
                        sched.get_last_lr()[0], (time.time() - tic) / 50)
            tic = time.time()

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        torch.save({f"mm_projector.{k}": v.cpu() for k, v in model.projector.state_dict().items()},
                   os.path.join(args.output, "mm_projector.bin"))
        logger.info("saved projector to %s", args.output)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
