from tangram.kernels.bench import main

main()
