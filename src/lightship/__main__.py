from lightship._start import main

main()
