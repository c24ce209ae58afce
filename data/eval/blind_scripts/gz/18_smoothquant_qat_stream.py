"""SmoothQuant migration + W8A8 QAT fine-tuning for OPT models, streaming data.

Stage 1: per-channel activation maxima of the inputs to q/k/v and fc1 are
collected on calibration text (max over ranks), and the difficulty is migrated
into the weights with s_j = max|X_j|^a / max|W_j|^(1-a).
Stage 2: short W8A8 fake-quant fine-tune. The corpus is a directory of jsonl
shards that is too large to index, so it is streamed: every rank reads its own
subset of the shard files.

    torchrun --nproc_per_node=8 18_smoothquant_qat_stream.py --shards "/data/pile_subset/*.jsonl"
"""
import argparse
import glob
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from transformers import AutoModelForCausalLM, AutoTokenizer


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="facebook/opt-1.3b")
    ap.add_argument("--shards", default="/data/pile_subset/*.jsonl")
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--calib_blocks", type=int, default=64)
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--out", default="ckpt/opt-1.3b-sq-w8a8")
    return ap.parse_args()


class ShardStream(IterableDataset):
    def __init__(self, files, tok, block):
        self.files, self.tok, self.block = files, tok, block

    def __iter__(self):
        wi = get_worker_info()
        files = self.files if wi is None else self.files[wi.id::wi.num_workers]
        buf = []
        for fn in files:
            with open(fn) as f:
                for line in f:
                    buf.extend(self.tok(json.loads(line)["text"]).input_ids + [self.tok.eos_token_id])
                    while len(buf) >= self.block:
                        yield torch.tensor(buf[:self.block])
                        buf = buf[self.block:]


def fq_sym(x, dim=None, bits=8):
    qmax = 2 ** (bits - 1) - 1
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    s = amax.clamp(min=1e-5) / qmax
    return x + (torch.clamp(torch.round(x / s), -qmax - 1, qmax) * s - x).detach()


class W8A8Linear(nn.Linear):
    @classmethod
    def wrap(cls, lin):
        new = cls(lin.in_features, lin.out_features, bias=lin.bias is not None,
                  device=lin.weight.device, dtype=lin.weight.dtype)
        new.weight, new.bias = lin.weight, lin.bias
        return new

    def forward(self, x):
        # per-token activations, per-channel weights
        return F.linear(fq_sym(x, dim=-1), fq_sym(self.weight, dim=1), self.bias)


@torch.no_grad()
def collect_act_max(model, blocks, device):
    act_max = {}

    def hook(name):
        def fn(m, inp, out):
            x = inp[0].detach().reshape(-1, inp[0].shape[-1]).abs().amax(0).float()
            act_max[name] = torch.maximum(act_max[name], x) if name in act_max else x
        return fn

    hs = []
    for i, layer in enumerate(model.model.decoder.layers):
        hs.append(layer.self_attn.q_proj.register_forward_hook(hook(f"{i}.qkv")))
        hs.append(layer.fc1.register_forward_hook(hook(f"{i}.fc1")))
    for b in blocks:
        model(b.unsqueeze(0).to(device))
    for h in hs:
        h.remove()
    for k in sorted(act_max):
        dist.all_reduce(act_max[k], op=dist.ReduceOp.MAX)
    return act_max


@torch.no_grad()
def smooth(ln, linears, amax, alpha):
    wmax = torch.cat([l.weight.abs() for l in linears], 0).amax(0).float().clamp(min=1e-5)
    s = (amax.pow(alpha) / wmax.pow(1 - alpha)).clamp(min=1e-5)
    ln.weight.div_(s.to(ln.weight.dtype))
    ln.bias.div_(s.to(ln.bias.dtype))
    for l in linears:
        l.weight.mul_(s.view(1, -1).to(l.weight.dtype))


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(args.model)
    files = sorted(glob.glob(args.shards))
    my_files = files[rank::world]
    stream = ShardStream(my_files, tok, args.block)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).to(device).eval()

    # ---- stage 1: SmoothQuant ----
    calib = []
    for b in stream:
        calib.append(b)
        if len(calib) >= args.calib_blocks // world:
            break
    act_max = collect_act_max(model, calib, device)
    for i, layer in enumerate(model.model.decoder.layers):
        at = layer.self_attn
        smooth(layer.self_attn_layer_norm, [at.q_proj, at.k_proj, at.v_proj], act_max[f"{i}.qkv"], args.alpha)
        smooth(layer.final_layer_norm, [layer.fc1], act_max[f"{i}.fc1"], args.alpha)
    n = 0
    for mod in list(model.modules()):
        for cname, child in list(mod.named_children()):
            if isinstance(child, nn.Linear) and cname != "lm_head":
                setattr(mod, cname, W8A8Linear.wrap(child))
                n += 1
    if rank == 0:
        print(f"smoothed {len(model.model.decoder.layers)} layers (alpha={args.alpha}), "
              f"{n} W8A8 linears; {len(files)} shard files", flush=True)

    # ---- stage 2: QAT fine-tune ----
    model.train()
    model = DDP(model, device_ids=[local_rank])
    loader = DataLoader(stream, batch_size=args.bs, num_workers=4, pin_memory=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    step = 0
    for epoch in range(args.epochs):
        t0 = time.time()
        for ids in loader:
            ids = ids.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {l.item():.4f} "
                          f"{(time.time() - t0) / 50:.2f}s/step", flush=True)
                t0 = time.time()

        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "alpha": args.alpha, "epoch": epoch},
                       os.path.join(args.out, f"epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
