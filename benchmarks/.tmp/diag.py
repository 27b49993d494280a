import subprocess, sys
cases = {
 "cpu_mismatch": "x=torch.randn(1,1,4,8); torch.ops.flashmod.attention(x,x.half(),x)",
 "cuda_mismatch": "x=torch.randn(1,1,4,8,device='cuda'); torch.ops.flashmod.attention(x,x.half(),x)",
 "cuda_fp64": "x=torch.randn(1,1,4,8,device='cuda',dtype=torch.float64); torch.ops.flashmod.attention(x,x,x)",
 "cuda_d264": "x=torch.randn(1,1,4,264,device='cuda',dtype=torch.half); torch.ops.flashmod.attention(x,x,x)",
}
for name, code in cases.items():
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", "import torch, flashmod.ops\n" + code], capture_output=True, text=True)
    print(name, "rc", r.returncode, (r.stderr.strip().splitlines() or [""])[-1][:200])
