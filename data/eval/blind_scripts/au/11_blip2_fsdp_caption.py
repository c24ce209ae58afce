"""BLIP-2 (OPT-2.7B) caption fine-tuning on COCO with PyTorch FSDP.

The ViT-g and OPT are frozen; the Q-Former, query tokens and the language projection are trained.
Frozen and trainable parameters share FSDP units, hence use_orig_params=True.

    torchrun --nproc_per_node=8 11_blip2_fsdp_caption.py --ann-dir /data/coco/karpathy \
        --image-root /data/coco/images --out runs/blip2_opt27_coco
"""
import argparse
import functools
import json
import os

import torch
import torch.distributed as dist
from PIL import Image
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import Blip2ForConditionalGeneration, Blip2Processor
from transformers.models.blip_2.modeling_blip_2 import Blip2EncoderLayer, Blip2QFormerLayer
from transformers.models.opt.modeling_opt import OPTDecoderLayer


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Salesforce/blip2-opt-2.7b")
    p.add_argument("--ann-dir", required=True)
    p.add_argument("--image-root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--max-txt-len", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=20)
    p.add_argument("--val-images", type=int, default=5000)
    return p.parse_args()


class Captions(Dataset):
    def __init__(self, ann, image_root, train):
        self.ann = ann
        self.root = image_root
        self.train = train

    def __len__(self):
        return len(self.ann)

    def __getitem__(self, i):
        a = self.ann[i]
        img = Image.open(os.path.join(self.root, a["image"])).convert("RGB")
        if self.train:
            return img, a["caption"].strip()
        return img, int(a["image"].split("_")[-1][:-4])


@torch.no_grad()
def greedy_captions(model, processor, pixel_values, gen_len):
    # goes through the FSDP root forward each step; fixed length so every rank issues the same collectives
    bos = processor.tokenizer.bos_token_id
    ids = torch.full((pixel_values.size(0), 1), bos, dtype=torch.long, device=pixel_values.device)
    for _ in range(gen_len):
        logits = model(pixel_values=pixel_values, input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return processor.batch_decode(ids, skip_special_tokens=True)


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    processor = Blip2Processor.from_pretrained(args.model)
    model = Blip2ForConditionalGeneration.from_pretrained(args.model, torch_dtype=torch.float32)
    model.vision_model.requires_grad_(False)
    model.language_model.requires_grad_(False)

    wrap = functools.partial(transformer_auto_wrap_policy,
                             transformer_layer_cls={Blip2EncoderLayer, Blip2QFormerLayer, OPTDecoderLayer})
    model = FSDP(model, auto_wrap_policy=wrap, use_orig_params=True, device_id=device,
                 sharding_strategy=ShardingStrategy.FULL_SHARD, limit_all_gathers=True,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.bfloat16))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.wd)

    train_ann = json.load(open(os.path.join(args.ann_dir, "coco_karpathy_train.json")))
    val_ann = json.load(open(os.path.join(args.ann_dir, "coco_karpathy_val.json")))[: args.val_images]
    refs = {int(a["image"].split("_")[-1][:-4]): a["caption"] for a in val_ann}

    def train_collate(batch):
        enc = processor(images=[b[0] for b in batch], text=[b[1] + "\n" for b in batch], padding="longest",
                        truncation=True, max_length=args.max_txt_len, return_tensors="pt")
        enc["labels"] = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        return enc

    def val_collate(batch):
        pix = processor(images=[b[0] for b in batch], return_tensors="pt")["pixel_values"]
        return pix, torch.tensor([b[1] for b in batch])

    train_ds = Captions(train_ann, args.image_root, train=True)
    val_ds = Captions(val_ann, args.image_root, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                              collate_fn=train_collate, drop_last=True, pin_memory=True)
    # default DistributedSampler pads val to a multiple of world size -> equal step counts; duplicates removed below
    val_loader = DataLoader(val_ds, batch_size=32, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=4, collate_fn=val_collate)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_loader))

    best = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for it, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            if it % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} it {it}/{len(train_loader)} loss {l.item():.4f}", flush=True)

        model.eval()
        preds = []
        for pix, image_ids in val_loader:
            caps = greedy_captions(model, processor, pix.to(device), args.gen_len)
            preds += [(int(i), c.strip()) for i, c in zip(image_ids, caps)]
        gathered = [None] * world
        dist.all_gather_object(gathered, preds)

        cider = torch.zeros(1, device=device)
        if rank == 0:
            res = {i: [{"caption": c}] for part in gathered for i, c in part}
            gts = {i: [{"caption": c} for c in refs[i]] for i in res}
            tok = PTBTokenizer()
            cider[0], _ = Cider().compute_score(tok.tokenize(gts), tok.tokenize(res))
            print(f"epoch {epoch} val CIDEr {cider.item():.4f} on {len(res)} images", flush=True)
        dist.broadcast(cider, src=0)

        # every rank enters the state_dict call; only rank 0 receives the (CPU) full dict
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            full = model.state_dict()
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            keep = {k: v for k, v in full.items()
                    if k.startswith(("qformer.", "query_tokens", "language_projection."))}
            torch.save(keep, os.path.join(args.out, f"trainable_epoch{epoch}.pt"))
            if cider.item() > best:
                torch.save(keep, os.path.join(args.out, "trainable_best.pt"))
        best = max(best, cider.item())
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
