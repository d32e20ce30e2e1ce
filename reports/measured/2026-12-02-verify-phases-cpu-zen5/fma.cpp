#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>
double run(long iters){
  __m512 a[12]; __m512 x=_mm512_set1_ps(1.0000001f), y=_mm512_set1_ps(0.9999999f);
  for(int i=0;i<12;i++) a[i]=_mm512_set1_ps(i);
  for(long it=0;it<iters;it++){
    #pragma GCC unroll 12
    for(int i=0;i<12;i++) a[i]=_mm512_fmadd_ps(a[i],x,y);
  }
  __m512 s=a[0]; for(int i=1;i<12;i++) s=_mm512_add_ps(s,a[i]);
  return _mm512_reduce_add_ps(s);
}
int main(){
  long iters=200000000;
  for(int th=1;th<=2;th++){
    auto t=std::chrono::steady_clock::now();
    std::vector<std::thread> ts; std::vector<double> r(th);
    for(int i=0;i<th;i++) ts.emplace_back([&,i]{r[i]=run(iters);});
    for(auto&x:ts) x.join();
    double s=std::chrono::duration<double>(std::chrono::steady_clock::now()-t).count();
    printf("%d threads: %.1f GFLOP/s (%g)\n", th, th*iters*12.0*16*2/s/1e9, r[0]);
  }
}
